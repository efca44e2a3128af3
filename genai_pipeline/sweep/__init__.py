"""sweep: `genai sweep SPEC.yaml --out DIR`, which program to ship. Every (model, variant) of a spec
is exported, verified, evaluated and benchmarked as tasks on Ray, and the results compared.

spec.py     the YAML spec as frozen dataclasses (torch-free)
tasks.py    a task's stages (export + eval, bench) and the key of its inputs
run.py      the tasks on Ray: resources, retries, skipping what is finished, progress
report.py   sweep.json and report.html: the Pareto chart, the table, a recommendation per size class
"""
