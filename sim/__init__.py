"""
The simulators: the real scheduler and block manager at GPU scale with no model, one engine
(simulate.py) or several (simulate_cluster.py), each step timed by a roofline (cost_model.py).
`python -m sim ...` runs them (cli.py). They import the core; the core never imports them.
"""
