-- One database per service (each service owns its tables and migrates them
-- on start). Run once by the postgres image's entrypoint on an empty volume.
CREATE DATABASE berth_gateway;
CREATE DATABASE berth_session;
CREATE DATABASE berth_environment;
CREATE DATABASE berth_sandbox;
