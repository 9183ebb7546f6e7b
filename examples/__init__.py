"""Examples of agent hosts in front of runcap (not part of the installed package)."""
