"""`python -m sim ...`: the simulators' command line (sim/cli.py)."""
from sim.cli import main

main()
