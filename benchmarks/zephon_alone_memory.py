"""Zephon alone over a long run: its memory, without zephon-ray.

    python benchmarks/zephon_alone_memory.py [STEPS] [EVERY] [SEQ_LEN]      # default 40000 4000 64

One Zephon rank owning all 8 lanes of recipes/tiny.toml (rows of SEQ_LEN tokens; tiny.toml has 64), built from
Zephon's public API by the test oracle (tests/oracle.py, which shares no code with zephon_ray), consumed as Zephon
emits it (one microbatch per lane per step). Every EVERY steps it prints the process's RSS and how many microbatches Zephon holds (``SampleBatch`` objects
alive: its tail round-robin buffers the lanes that run ahead of the one it waits for), in all and by lane. The reference that tells
growth in zephon-ray's producers from growth in Zephon (docs/benchmarks.md, "Memory over a long run").
"""

import gc
import logging
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import oracle  # noqa: E402
from zephon import Pipeline  # noqa: E402

SEQ_LEN = int(sys.argv[3]) if len(sys.argv) > 3 else 64
# tiny.toml at SEQ_LEN, its data paths made absolute (the copy lives in a temporary directory)
recipe_path = Path(tempfile.mkdtemp()) / "tiny.toml"
recipe_path.write_text(
    (ROOT / "recipes" / "tiny.toml")
    .read_text()
    .replace('path = "data/', f'path = "{ROOT}/recipes/data/')
    .replace("seq_len = 64", f"seq_len = {SEQ_LEN}")
)
recipe = oracle.read_recipe(recipe_path)
# Zephon logs each packing tail it drops (about 20 a step at seq_len 8,192): harmless here, and it buries the rows
logging.getLogger("zephon._internal.ops.pack_sequences").setLevel(logging.ERROR)
tok = oracle.make_tokenizer(recipe.tokenizer)
p = (
    Pipeline(oracle.work_source(recipe))
    .decode_text()
    .tokenize(tokenizer=tok, field=recipe.text_field, return_tensors="np")
    .pack_flat(
        max_length=recipe.seq_len + 1,
        algorithm=recipe.packing,
        num_bins=recipe.packing_bins,
        pad_token_id=tok.pad_token_id,
    )
    .batch(recipe.m)
)
opts = dict(
    canonical_replicas=recipe.lanes,
    mapping_strategy="contiguous",
    world_size=1,
    global_rank=0,
    dp_degree=1,
    dp_group_id=0,
    run_id="z",
    aggregate_dir=tempfile.mkdtemp(),
    runner="threads",
)
if recipe.flush_every_k_chunks is not None:
    opts["flush_every_k_chunks"] = recipe.flush_every_k_chunks
p = p.options(**opts)
it = iter(p)
proc = psutil.Process()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40000
every = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
per_step = recipe.lanes  # one microbatch per lane per step (tiny: k = 1)
t0 = time.time()
for step in range(1, steps + 1):
    for _ in range(per_step):
        next(it)
    if step % every == 0:
        gc.collect()
        batches = [o for o in gc.get_objects() if type(o).__name__ == "SampleBatch"]
        by_lane = Counter(int(o.lane_ids[0]) for o in batches if len(o.lane_ids))
        held = len(batches)
        del batches  # held to the next report, they would stay alive, and be counted, there
        rss = proc.memory_info().rss / 2**20
        print(
            f"step {step:>7} {time.time() - t0:6.0f} s  microbatches held {held:>6} "
            f"(by lane {[by_lane.get(lane, 0) for lane in range(recipe.lanes)]})  rss {rss:7.1f} MB",
            flush=True,
        )
it.close()  # stop Zephon's threads before the interpreter shuts down under them
