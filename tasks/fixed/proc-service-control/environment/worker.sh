#!/bin/bash
# Appends a heartbeat line every 0.2 s, forever.
while true; do
  date +%s.%N >> /app/heartbeat.log
  sleep 0.2
done
