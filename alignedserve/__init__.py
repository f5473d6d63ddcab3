"""AlignedServe: an LLM serving engine built around length-aligned decode batching."""

from alignedserve.outputs import CompletionOutput, RequestOutput
from alignedserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import alignedserve` is cheap.
    if name == "LLM":
        from alignedserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
