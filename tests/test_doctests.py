"""Every docstring example of jaxmem's public building blocks runs and prints what it says
(issue 29, point 5): the modules behind `jaxmem.optim`, `jaxmem.loss`, `jaxmem.remat`,
`jaxmem.quant`, `jaxmem.lora`, `jaxmem.xla.analysis`, `jaxmem.xla.hlo`, `jaxmem.dtypes` and
`jaxmem.bits`, their private submodules included (the public names live there). fp32 matmuls
run at full precision (tests/testenv.py), so printed numbers are the same on a CPU and a GPU."""

import doctest
import importlib
import pkgutil

import pytest

PUBLIC = ("jaxmem.optim", "jaxmem.loss", "jaxmem.remat", "jaxmem.quant", "jaxmem.lora",
          "jaxmem.xla.analysis", "jaxmem.xla.hlo", "jaxmem.dtypes", "jaxmem.bits")


def modules() -> list[str]:
    """The public modules and, where one is a package, every module inside it."""
    out = []
    for name in PUBLIC:
        mod = importlib.import_module(name)
        out.append(name)
        if hasattr(mod, "__path__"):
            out += [m.name for m in pkgutil.walk_packages(mod.__path__, name + ".")
                    if not m.name.endswith("__main__")]
    return out


def examples(name: str) -> list[doctest.DocTest]:
    mod = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(mod, name) if t.examples]


@pytest.mark.parametrize("name", modules())
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_enough_examples():
    """The building blocks carry examples (at least 25 in all)."""
    count = sum(len(t.examples) for name in modules() for t in examples(name))
    assert count >= 25, count
