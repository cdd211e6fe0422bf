"""Pictures (matplotlib, the optional `plot` extra: `pip install -e '.[plot]'`).

    curves   a run's metrics.jsonl over steps (loss, eval loss, lr, loss scale, skipped steps),
             several runs overlaid; `python -m jaxmem.plot RUN_DIR ... --out curves.png`
    memory   a step's memory by category as stacked bars (`python -m jaxmem.memory --plot`)
    cli      `python -m jaxmem.plot`

Each function returns a `matplotlib.figure.Figure` (no pyplot global state), so tests inspect
the lines and bars and programs save it with `save(fig, path)`.
"""
