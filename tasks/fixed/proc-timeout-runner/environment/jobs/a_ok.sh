#!/bin/bash
echo fine
