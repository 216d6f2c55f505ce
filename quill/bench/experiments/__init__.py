"""Experiments that set real measurements on this machine beside the cost model's and the
simulator's predictions, and write docs/experiments.md from them (`quill bench experiments`).

One module per experiment (reading, batching, cost, interference, load), each with `needs`,
`run` and `describe`; `driver` runs them, `figures` draws them, `report` writes the document.
"""
