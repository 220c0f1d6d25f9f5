"""What NormXLogit computes: functions of tensors and the model's own modules, no hooks.

- :mod:`.head`: the head-on-top per token (features, gathered target logits, logit post-processing)
- :mod:`.placement`: devices, offload, quantized and adapter modules
- :mod:`.select`: layers, prediction rows, target ids, which tokens rank
- :mod:`.chat`: which tokens of a chat-templated prompt the template put there (they do not rank)
- :mod:`.protocol`: :class:`~.protocol.Method`, what an attribution method is given and returns
- :mod:`.registry`: the registered methods (:func:`~.registry.register_method`, entry points ``nxl_hooks.methods``)
- :mod:`.methods`: the built-in methods, one file each (NormXLogit, LogAt, contrastive)
- :mod:`.scores`: LogAt into every method's scores
"""
