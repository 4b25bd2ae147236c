"""Engine integrations: small modules over the public API, switched on through each
engine's own plugin mechanism (``vllm.general_plugins``, ``sglang.srt.plugins``).

Importing this package imports no engine; each integration imports its engine lazily and,
where the engine's internals differ from what it expects, warns naming the difference and
leaves the engine as it would run without the plugin.
"""
