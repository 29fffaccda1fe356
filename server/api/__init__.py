"""HTTP layer: FastAPI app, OpenAI schemas, SSE. Imports only torch-free engine types."""
