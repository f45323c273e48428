"""A toy vLLM hardware plugin, as a plugin's repository would wire it into pytest-kvconform."""
