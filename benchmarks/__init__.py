"""The experiment drivers behind `python bench.py`: each file measures one family of claims. The engine never imports them."""
