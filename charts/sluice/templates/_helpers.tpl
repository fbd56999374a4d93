{{/* The chart name, or nameOverride. */}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name for every object. */}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "sluice.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "sluice.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The gateway pods (not the optional Redis). */}}
{{- define "sluice.gatewaySelectorLabels" -}}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sluice.redisName" -}}
{{- printf "%s-redis" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The gateway's sluice.yaml: the user's `config`, with what the chart owns set
from the values (listeners, drain, Redis when the chart runs it, keys file).
*/}}
{{- define "sluice.config" -}}
{{- $cfg := deepCopy (default (dict) .Values.config) -}}
{{- $server := deepCopy (default (dict) $cfg.server) -}}
{{- $_ := set $server "listen" (printf "0.0.0.0:%d" (int .Values.ports.api)) -}}
{{- $_ := set $server "admin_listen" (printf "0.0.0.0:%d" (int .Values.ports.admin)) -}}
{{- $_ := set $server "drain_timeout" (printf "%ds" (int .Values.drainTimeoutSeconds)) -}}
{{- if .Values.adminAuth.existingSecret -}}
{{- $_ := set $server "admin_auth" (dict "token_file" (printf "/etc/sluice/admin/%s" .Values.adminAuth.key) "metrics_open" .Values.adminAuth.metricsOpen) -}}
{{- end -}}
{{- if .Values.tls.existingSecret -}}
{{- $tls := deepCopy (default (dict) $server.tls) -}}
{{- $_ := set $tls "cert_file" "/etc/sluice/tls/tls.crt" -}}
{{- $_ := set $tls "key_file" "/etc/sluice/tls/tls.key" -}}
{{- $_ := set $tls "admin" .Values.tls.admin -}}
{{- if .Values.tls.clientCA -}}
{{- $_ := set $tls "client_ca_file" "/etc/sluice/tls/ca.crt" -}}
{{- end -}}
{{- $_ := set $server "tls" $tls -}}
{{- end -}}
{{- $_ := set $cfg "server" $server -}}
{{- if .Values.upstreamTls.existingSecret -}}
{{- $up := deepCopy (default (dict) $cfg.upstream) -}}
{{- $utls := deepCopy (default (dict) $up.tls) -}}
{{- $_ := set $utls "ca_file" "/etc/sluice/upstream-tls/ca.crt" -}}
{{- if .Values.upstreamTls.clientCertificate -}}
{{- $_ := set $utls "cert_file" "/etc/sluice/upstream-tls/tls.crt" -}}
{{- $_ := set $utls "key_file" "/etc/sluice/upstream-tls/tls.key" -}}
{{- end -}}
{{- $_ := set $up "tls" $utls -}}
{{- $_ := set $cfg "upstream" $up -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- $rl := deepCopy (default (dict) $cfg.rate_limits) -}}
{{- $redis := deepCopy (default (dict) $rl.redis) -}}
{{- $_ := set $rl "store" "redis" -}}
{{- $_ := set $redis "url" (printf "redis://%s:6379" (include "sluice.redisName" .)) -}}
{{- $_ := set $rl "redis" $redis -}}
{{- $_ := set $cfg "rate_limits" $rl -}}
{{- /* The routing table too (sessions, prefix homes), unless the config says otherwise. */ -}}
{{- $routing := deepCopy (default (dict) $cfg.routing) -}}
{{- $sessions := deepCopy (default (dict) $routing.sessions) -}}
{{- if not (hasKey $sessions "store") -}}
{{- $_ := set $sessions "store" "redis" -}}
{{- end -}}
{{- if eq $sessions.store "redis" -}}
{{- $sredis := deepCopy (default (dict) $sessions.redis) -}}
{{- if not (hasKey $sredis "url") -}}
{{- $_ := set $sredis "url" (printf "redis://%s:6379" (include "sluice.redisName" .)) -}}
{{- end -}}
{{- $_ := set $sessions "redis" $sredis -}}
{{- end -}}
{{- $_ := set $routing "sessions" $sessions -}}
{{- $_ := set $cfg "routing" $routing -}}
{{- end -}}
{{- if .Values.apiKeys.existingSecret -}}
{{- $auth := deepCopy (default (dict) $cfg.auth) -}}
{{- $_ := set $auth "keys_file" (printf "/etc/sluice/keys/%s" .Values.apiKeys.key) -}}
{{- $_ := set $cfg "auth" $auth -}}
{{- end -}}
{{- if eq .Values.mode "epp" -}}
{{- $epp := deepCopy (default (dict) $cfg.epp) -}}
{{- $_ := set $epp "listen" (printf "0.0.0.0:%d" (int .Values.ports.epp)) -}}
{{- $_ := set $epp "health_listen" (printf "0.0.0.0:%d" (int .Values.ports.eppHealth)) -}}
{{- $_ := set $cfg "epp" $epp -}}
{{- $source := dict "inference_pool" (include "sluice.poolName" .) -}}
{{- with .Values.inferencePool.models -}}
{{- $_ := set $source "models" . -}}
{{- end -}}
{{- $_ := set $cfg "discovery" (dict "kubernetes" (list $source)) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end }}

{{/* mode: epp: the InferencePool's name. */}}
{{- define "sluice.poolName" -}}
{{- default (include "sluice.fullname" .) .Values.inferencePool.name -}}
{{- end }}

{{/* The rendered config's `discovery.kubernetes` sources, as YAML (a list, or nothing). */}}
{{- define "sluice.kubeSources" -}}
{{- $cfg := include "sluice.config" . | fromYaml -}}
{{- with (($cfg.discovery | default dict).kubernetes) -}}
{{- toYaml . -}}
{{- end -}}
{{- end }}
