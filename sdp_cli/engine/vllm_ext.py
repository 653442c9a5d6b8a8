"""vLLM worker extension shipped with sdp: weight reload that is correct on the CPU backend.

This module runs inside the vLLM server's worker processes, in the server's own virtualenv,
so it may import only the standard library and vllm. sdp copies it next to the server's logs
and passes ``--worker-extension-cls sdp_vllm_ext.SdpWorkerExtension`` (see ``servers.py``).

Why it exists (docs/engines.md "vLLM"): the CPU backend packs each linear layer's weight
into a oneDNN handle at load time. ``Worker.reload_weights`` re-packs every layer whose weight
is in the checkpoint, but a model with tied embeddings has no ``lm_head.weight`` there, so the
head keeps computing logits with the *old* embedding. Re-dispatching the head after the reload
re-packs it from the (tied, now new) embedding weight.
"""


class SdpWorkerExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker."""

    def reload_weights_cpu(self, weights_path: str) -> bool:
        """Reload every weight from ``weights_path`` and re-pack the LM head.

        Returns True when the head was re-packed (a head with an empty weight was freed by the
        backend and is rebuilt by the reload itself).
        """
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        self.reload_weights(weights_path=weights_path)
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        if weight is None or weight.numel() == 0:
            return False
        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        return True
