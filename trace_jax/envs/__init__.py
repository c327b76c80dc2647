"""Agent environments: the ReAct search protocol, retrievers and rewards."""
