"""Disaggregated prefill and decode: moving a request's KV cache between two instances.

The transfer runs on torch.distributed point-to-point (gloo on the CPU, NCCL on CUDA), in a
process group of two made for each prefill/decode pair, never a transport of our own.
"""
