"""Checkpoint files: reading and writing the Hugging Face layout for every model family.

hub (the only module that touches the network), loading (the key table, the strict report, save),
lora (adapters), loader (`load`, the front door users call). Safe reads of one file: ../files.py.
"""
