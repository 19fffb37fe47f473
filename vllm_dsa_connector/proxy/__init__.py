"""The P/D proxy: the app (``python -m vllm_dsa_connector.proxy.app``) and its request rules."""
