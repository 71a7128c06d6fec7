"""``python -m ucm_db.tools.bench NAME ...``: the ``ucm-db bench`` group without the installed script."""

from ucm_db.tools.cli_bench import bench_group

if __name__ == "__main__":
    bench_group(prog_name="python -m ucm_db.tools.bench")
