"""`mps-serve bench`: decode and prefill speed through the real Engine, as a fraction of the device's measured
copy bandwidth, side by side with transformers.

Modules: `options` (the command line, argparse only), `presets` (server/configs/presets/*.toml), `random_model`
(real shapes, random weights, built on the device), `measure` (copy bandwidth, weight bytes, steady rates),
`peer` (the transformers side), `report` (JSON lines and the table), `run` (the whole run).
Nothing here imports server.api: the bench runs where fastapi/uvicorn are not installed.
"""
