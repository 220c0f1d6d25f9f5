"""The built-in attribution methods, one file each, each defining ``METHOD`` (a
:class:`~nxl_hooks.method.protocol.Method`): every module of this package is registered by
:mod:`nxl_hooks.method.registry` the first time a method is looked up. A new built-in method is one file here
(plus its test)."""
