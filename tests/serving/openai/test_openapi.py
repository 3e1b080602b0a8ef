"""The served OpenAPI document: the real request bodies and error responses of every route."""

import pytest

from hybridserve.serving.openai.batches.protocol import CreateBatchRequest
from hybridserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest
from hybridserve.serving.openai.tokenize import DetokenizeRequest, TokenizeRequest
from tests.serving.helpers import error_body
from tests.serving.openapi_schema import check

BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/batches": CreateBatchRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


@pytest.fixture
def document(client) -> dict:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _ref(document: dict, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/"), ref
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path", BODIES)
def test_json_endpoints_publish_their_request_model(document, path):
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    ref = body["content"]["application/json"]["schema"]["$ref"]
    model = BODIES[path]
    assert ref == f"#/components/schemas/{model.__name__}"
    schema = _ref(document, ref)
    assert set(schema["properties"]) == set(model.model_fields)
    assert set(schema.get("required", ())) == {name for name, f in model.model_fields.items() if f.is_required()}
    for prop in schema["properties"].values():  # nested models resolve inside the document
        for branch in prop.get("anyOf", [prop]):
            if "$ref" in branch:
                _ref(document, branch["$ref"])


@pytest.mark.parametrize(
    ("path", "statuses"),
    [
        ("/v1/chat/completions", {"400", "401", "404", "413", "500", "503"}),
        ("/v1/completions", {"400", "401", "404", "413", "500", "503"}),
        ("/v1/responses", {"400", "401", "404", "413", "500", "503", "507"}),
        ("/v1/batches", {"400", "401", "404", "413", "429", "500", "507"}),
        ("/v1/files", {"400", "401", "413", "500", "507"}),
        ("/tokenize", {"400", "401", "404", "413", "500"}),  # guarded by --api-key as /v1 is
        ("/detokenize", {"400", "401", "404", "413", "500"}),
    ],
)
def test_endpoints_publish_their_error_responses_in_openai_shape(document, path, statuses):
    responses = document["paths"][path]["post"]["responses"]
    assert set(responses) == {"200"} | statuses
    for status in statuses:
        ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse"
    error = _ref(document, "#/components/schemas/ErrorResponse")
    detail = _ref(document, error["properties"]["error"]["$ref"])
    assert set(detail["properties"]) == set(detail["required"]) == {"message", "type", "param", "code"}


def test_no_route_documents_fastapis_422(document):
    """Validation errors are answered 400 in OpenAI's shape, so no route lists FastAPI's 422 or its schema."""
    for operations in document["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_streaming_endpoints_document_both_content_types(document):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}


def test_upload_documents_its_multipart_form(document):
    schema = document["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert schema["required"] == ["file", "purpose"]
    assert schema["properties"]["file"] == {"type": "string", "format": "binary"}
    assert schema["properties"]["expires_after[seconds]"] == {"type": "integer", "minimum": 3600, "maximum": 2592000}


def test_output_expiry_publishes_its_range(document):
    batch = _ref(document, "#/components/schemas/CreateBatchRequest")
    ref = next(b["$ref"] for b in batch["properties"]["output_expires_after"]["anyOf"] if "$ref" in b)
    expiry = _ref(document, ref)
    assert expiry["required"] == ["anchor", "seconds"]
    assert (expiry["properties"]["seconds"]["minimum"], expiry["properties"]["seconds"]["maximum"]) == (3600, 2592000)
    assert expiry["properties"]["anchor"]["const"] == "created_at"


def test_a_documented_error_is_what_the_server_sends(client):
    r = client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404
    assert r.json() == error_body("The model `nope` does not exist.", param="model", code="model_not_found")
    check(r.json(), "ErrorResponse")
