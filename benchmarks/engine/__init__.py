"""The parts of the engine benchmarks: bench_engine.py (offline) and bench_http.py (HTTP).

The scripts are only their command lines and runs; each module here has one job (a column, the
machine, the report, the servers, the clients), so that both benchmarks share what they can.
"""
