"""LlamaIndex on the PCD engine: ``PCDLLM`` (a function-calling LLM, ``llm.py``), ``PCDProgram`` (the
pydantic-program slot, ``program.py``) and ``PCDSelector`` (the router's selector slot, ``selector.py``),
with prompts and messages turned into the engine's input text in one place (``text.py``).

The names users import from ``pcd_integrations.llama_index`` are re-exported here; importing them
without the ``llama-index`` extra raises ``BackendUnavailableError`` with the install hint
(``tests/test_llama_index.py`` checks it in a fresh process).
"""

from pcd_integrations.llama_index.llm import ANSWER_DIRECTLY, PCDLLM
from pcd_integrations.llama_index.program import PCDProgram
from pcd_integrations.llama_index.selector import PCDSelector
from pcd_integrations.llama_index.text import prompt_to_text

__all__ = ["ANSWER_DIRECTLY", "PCDLLM", "PCDProgram", "PCDSelector", "prompt_to_text"]
