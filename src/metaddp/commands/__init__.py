"""Sub-commands of the ``metaddp`` command line."""
