"""Shipping a trained model: pack (a run into a starter folder with its manifest) and publish (stage
with a model card for `bert-engine push`; checkpoints.hub does the upload).
"""
