#!/bin/bash
sleep 300
