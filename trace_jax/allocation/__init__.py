"""TRACE allocation: root and prefix solvers, policies, the tree scheduler and a simulator."""
