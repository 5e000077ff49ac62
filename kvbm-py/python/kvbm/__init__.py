"""kvbm: a KV-cache block manager that tells you what it is doing.

``kvbm.vllm.KvbmConnector`` is vLLM's KV connector backed by kvbm's host and
disk tiers, with every slot, transfer and breakpoint visible in
``kvbm-console attach``. Enable it with::

    kv_transfer_config={
        "kv_connector": "KvbmConnector",
        "kv_connector_module_path": "kvbm.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"serve": "127.0.0.1:7071"},
    }
"""

from kvbm._kvbm import __version__, check_config

__all__ = ["__version__", "check_config"]
