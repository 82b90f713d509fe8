"""The official Python clients against a running Tessera deployment.

    check_clients.py BASE_URL API_TOKEN DEPLOYMENT

`openai` asks for base64 embeddings unless told otherwise, and `tritonclient[http]`
sends and receives binary tensors by default: both defaults are what is tested.
"""

import sys

import numpy as np
import tritonclient.http as triton
from openai import OpenAI

base_url, token, deployment = sys.argv[1:4]
texts = ["hello world", "Tessera serves transformer models on your own servers."]

client = OpenAI(base_url=f"{base_url}/v1", api_key=token)
by_default = client.embeddings.create(model=deployment, input=texts)
as_floats = client.embeddings.create(model=deployment, input=texts, encoding_format="float")
assert [d.index for d in by_default.data] == [0, 1]
openai_vectors = np.array([d.embedding for d in by_default.data], dtype=np.float32)
assert openai_vectors.shape == (2, 384), openai_vectors.shape
assert np.allclose(openai_vectors, np.array([d.embedding for d in as_floats.data]), atol=1e-6)
assert np.allclose(np.linalg.norm(openai_vectors, axis=1), 1.0, atol=1e-4)
assert by_default.usage.prompt_tokens > len(texts)
assert deployment in [m.id for m in client.models.list().data]
print("openai ok")

headers = {"Authorization": f"Bearer {token}"}
server = triton.InferenceServerClient(url=base_url.removeprefix("http://"))
assert server.is_server_live(headers=headers)
assert server.is_server_ready(headers=headers)
assert "binary_tensor_data" in server.get_server_metadata(headers=headers)["extensions"]
assert server.is_model_ready(deployment, headers=headers)
metadata = server.get_model_metadata(deployment, headers=headers)
assert metadata["outputs"][0]["datatype"] == "FP32", metadata
text_input = triton.InferInput("text", [len(texts)], "BYTES")
text_input.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
result = server.infer(deployment, [text_input], headers=headers)
triton_vectors = result.as_numpy("embedding")
assert triton_vectors.shape == (2, 384), triton_vectors.shape
cosine = np.sum(triton_vectors * openai_vectors, axis=1)
assert np.all(cosine > 0.9999), cosine
try:
    server.infer("no-such-deployment", [text_input], headers=headers)
    raise AssertionError("an unknown deployment must be refused")
except triton.InferenceServerException as error:
    assert "no-such-deployment" in str(error), error
print("tritonclient ok")
