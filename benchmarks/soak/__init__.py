"""Helpers of benchmarks/soak.py: the traffic it sends (traffic.py) and what it reports (report.py).

Kept apart from the script so that each part stays short enough to read in one sitting.
"""
