"""The public REST gateway: the Agents API over HTTP (FastAPI on uvicorn),
translated to the Session and Environment services' gRPC contracts.

Entry points: ``gateway.app.create_app`` / ``gateway.app.start_gateway`` and
``python -m gateway``; organizations and API keys in ``gateway.keys``.
"""
