"""The public surface users validate their own code with, importable from the package."""

import weight_sync_bench

PROMISED = ("ModelConfig TOY TOY_KV4 layout_for Replicate Shard HeadPartitioned FusedPaired "
            "ShardSpec LayoutTable UnsupportedLayout split gather reshard ReferenceModel "
            "ShardedModel InProcessCollective check_split check_reshard").split()


def test_every_promised_name_is_exported_and_resolves():
    assert set(PROMISED) <= set(weight_sync_bench.__all__)
    missing = [n for n in weight_sync_bench.__all__ if not hasattr(weight_sync_bench, n)]
    assert missing == []


def test_reshard_is_the_function_even_after_its_module_is_imported():
    import weight_sync_bench.layout.reshard  # noqa: F401  (the module of the same name)

    assert callable(weight_sync_bench.reshard) and weight_sync_bench.reshard.__name__ == "reshard"


def test_measuring_modules_run_as_scripts_without_runpy_warnings():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m",
                          "weight_sync_bench.tolerance", "--help"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
