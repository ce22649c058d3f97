#!/bin/bash
echo deploy
