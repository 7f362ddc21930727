from services.core.service import run_service_main
from services.session.server import start_session_service

run_service_main("session", start_session_service)
