"""Vision-language models: the image inputs a request carries (`inputs`), the vision towers that turn them
into rows of the language model's embeddings (one module per family), and the image processing that turns a
decoded picture into the tower's input and the prompt's placeholder run (`processing`). Towers run in the
same process as the decoder, in float32 on CPU."""

from llmserve.model.vision.inputs import ImageInput, PromptWithImages

__all__ = ["ImageInput", "PromptWithImages"]
