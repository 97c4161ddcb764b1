"""What runs inside the service's Ray actors: the coordinator (coordinator.py) with its step window (window.py),
producer pool (pool.py), replay scheduling (replay_scheduler.py), status report (status.py) and metrics
(metrics.py); the producer (producer.py), replayer (replayer.py) and node reader (node_reader.py) actors; and
launch.py, which ``DataService.start`` calls to create the coordinator.

A client process never imports this package to connect or read (the actor classes it builds handles of are the
shells in ``zephon_ray.service.actor_shells``).
"""
