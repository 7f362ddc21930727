from services.core.service import run_service_main
from services.sandbox.server import start_sandbox_service

run_service_main("sandbox", start_sandbox_service)
