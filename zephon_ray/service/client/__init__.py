"""What runs in the trainer's, loader's or notebook's process: :class:`DataService` (data_service.py), its read paths
(node_read_path.py, the default; direct_read_path.py), :class:`StepRefs` and the mapping of Ray's errors to the
service's (step_refs.py), and attaching to a Ray cluster (session.py).

Nothing here imports ``zephon_ray.service.server``, except ``DataService.start`` and ``stop``, which load
``server.launch`` when called: a process that connects and reads loads the shared modules of ``zephon_ray.service``
and this package only.
"""


def __getattr__(name: str):
    # Lazy, so that importing client.session (at the command line's start) imports neither Ray nor numpy.
    if name in ("DataService", "StepRefs"):
        from zephon_ray.service.client import data_service

        return getattr(data_service, name)
    raise AttributeError(name)
