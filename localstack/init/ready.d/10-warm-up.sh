#!/bin/bash
# LocalStack starts a service on its first request, and the first DynamoDB request may even
# download its engine. Making those first requests here means the health check (which waits for
# this script) passes only once the tests' first calls will not time out.
set -euo pipefail
awslocal kinesis list-streams > /dev/null
awslocal dynamodb list-tables > /dev/null
