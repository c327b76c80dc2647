"""Agent environments: the ReAct search protocol, retrieval and rewards.

``react`` judges turns; ``retriever`` picks a retriever from a config (``bm25`` in process, ``retrieval_client``
for a Search-R1 server) and serves one (``retrieval_server``); ``retrieval_base`` holds what they share.
"""
