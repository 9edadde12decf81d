"""Running a model: precision (one table) and the fast CPU kernels, time limits that stop a request
(cancel), the fair compute gate every forward pass goes through (fairness), ranks under torchrun
(distributed), and the Predictor: one model serving one task (inference).
"""
