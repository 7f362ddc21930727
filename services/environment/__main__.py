from services.core.service import run_service_main
from services.environment.server import start_environment_service

run_service_main("environment", start_environment_service)
