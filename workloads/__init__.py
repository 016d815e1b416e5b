"""What a run asks of a server: the requests (`requests.py`), which adapter each names
(`popularity.py`) and when each is sent (`arrivals.py`), all seeded. The routing cells' streams
(`router_cell.py`) are built here too, so the serving benchmarks and the fleet simulator read one
definition of the same requests.
"""
