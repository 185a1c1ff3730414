"""The pieces of ``benchmarks/fleet.py``, the fleet simulation: simulated inference workers
(``workers``), the parameter-server replicas and the fake trainer (``services``), the real
controller in a process of its own (``controller_host``), and the figures (``figures``).

Each piece runs in a child process the simulation spawns; it talks to the others over the real
HTTP protocols, and to the simulation over a ``multiprocessing`` pipe (``children``)."""
