"""kvlab: measure KV-cache quantization."""

import warnings

# transformers 5.x renames generate()/forward()'s `past_key_values` to `cache` and warns on every
# call; kvlab keeps the old name (accepted across 5.x), so silence that one warning.
warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated", category=FutureWarning)
