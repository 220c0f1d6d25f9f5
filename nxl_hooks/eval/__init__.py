"""Checking: how faithful the attributions are, and what a change of model (quantization) did to them.

- :mod:`.faithfulness`: AOPC comprehensiveness / sufficiency and evidence alignment, per example and aggregated
- :mod:`.metrics`: average precision, normalized dot product, evidence masks
- :mod:`.baselines`: the paper's gradient baselines through captum
- :mod:`.audit`: reference vs candidate model, token by token and layer by layer
"""
