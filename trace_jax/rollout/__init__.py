"""Rollout engine (jit decoding with forks), sampling, rollout trees and the multi-turn runner."""
