"""Registered tasks: the registry that loads task plugins (the contract itself is bert_engine.hookspecs),
a task's evaluation on labelled examples, and the conformance kit plugin authors run.
"""
