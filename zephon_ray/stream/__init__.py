"""The framework-free stream layer (imports no TorchTitan, no Ray Train, no triton).

* ``slice_stream``: the one narrow protocol of a slice stream (reset / next / state / close, state keys as constants);
* ``prefetch``: the one prefetch thread behind every slice stream;
* ``local``, ``service``, ``dataset``: the three slice streams (an in-process Zephon lane group, a DataService, a
  materialised directory);
* ``loader``: the loader core (reader r of W, modes, the loader state, trainer microbatches, TP/PP/CP peers) that
  the TorchTitan and Ray Train integrations adapt;
* ``geometry``: the trainer's batch geometry against the recipe; ``checkpoint_rendezvous``: where local-mode
  checkpoints meet; ``ledger_recorder``: the ledger records of the steps a reader handed out; ``mesh``: TP/PP/CP
  peers of a reader;
* ``ft``: per-step elasticity with torchft (``FtSlices``).
"""
