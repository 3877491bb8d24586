{{- define "otel-dra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "otel-dra.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The namespace of every namespaced object of the chart: the `namespace` value (the
     kube-dra-exporter chart's name for it), else the release namespace. It moves the resources
     only: the exporter still watches claims in every namespace. */}}
{{- define "otel-dra.namespace" -}}
{{- default .Release.Namespace .Values.namespace }}
{{- end }}

{{/* The existing ClusterRole to bind instead of the chart's own, or "" for the chart's own:
     rbac.useExistingRole=<name> (the kube-dra-exporter chart's form), or
     rbac.useExistingRole=true with rbac.existingRoleName. */}}
{{- define "otel-dra.existingRole" -}}
{{- $use := .Values.rbac.useExistingRole }}
{{- if kindIs "string" $use }}
{{- if and $use .Values.rbac.existingRoleName (ne $use .Values.rbac.existingRoleName) }}
{{- fail (printf "rbac.useExistingRole=%s and rbac.existingRoleName=%s name different ClusterRoles: set one of them" $use .Values.rbac.existingRoleName) }}
{{- end }}
{{- $use }}
{{- else if $use }}
{{- required "rbac.useExistingRole=true needs rbac.existingRoleName (or set rbac.useExistingRole to the ClusterRole's name)" .Values.rbac.existingRoleName }}
{{- end }}
{{- end }}

{{- define "otel-dra.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "otel-dra.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "otel-dra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "otel-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: exporter
{{- end }}

{{- define "otel-dra.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "otel-dra.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "otel-dra.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "otel-dra.validate" -}}
{{- if not .Values.rbac.useClusterRole }}
{{- fail "rbac.useClusterRole=false is not supported: the exporter lists and watches ResourceClaims in all namespaces and cluster-scoped ResourceSlices and DeviceClasses, which only a ClusterRole can grant" }}
{{- end }}
{{- if and .Values.exporter.metricAllowlist .Values.exporter.metricDenylist }}
{{- fail "exporter.metricAllowlist and exporter.metricDenylist are mutually exclusive (as --metric-allowlist and --metric-denylist are): set one of them" }}
{{- end }}
{{- $sec := .Values.metricsSecurity }}
{{- if and $sec.tls.enabled (not $sec.tls.existingSecret) (not $sec.tls.certManager.enabled) }}
{{- fail "metricsSecurity.tls.enabled needs metricsSecurity.tls.existingSecret (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt) or metricsSecurity.tls.certManager.enabled" }}
{{- end }}
{{- if and $sec.tls.certManager.enabled (not $sec.tls.enabled) }}
{{- fail "metricsSecurity.tls.certManager.enabled needs metricsSecurity.tls.enabled" }}
{{- end }}
{{- if and $sec.tls.certManager.enabled $sec.tls.existingSecret }}
{{- fail "metricsSecurity.tls.certManager.enabled and metricsSecurity.tls.existingSecret are mutually exclusive: the Certificate writes its own Secret" }}
{{- end }}
{{- if and $sec.tls.certManager.enabled (not $sec.tls.certManager.issuerRef.name) }}
{{- fail "metricsSecurity.tls.certManager.enabled needs metricsSecurity.tls.certManager.issuerRef.name" }}
{{- end }}
{{- if and .Values.podMonitor.enabled (eq $sec.authorization.mode "kubernetes") (not $sec.scraper.tokenSecret.name) }}
{{- fail "podMonitor.enabled with metricsSecurity.authorization.mode=kubernetes needs metricsSecurity.scraper.tokenSecret.name: a PodMonitor cannot send the Prometheus pod's own token file" }}
{{- end }}
{{- $_ := include "otel-dra.existingRole" . }}
{{- /* Options of the kube-dra-exporter chart that have no meaning here: accepted empty, as that
     chart accepts them, and rejected otherwise, as it rejects them. */}}
{{- if .Values.extraArgs }}
{{- fail "extraArgs is not supported (as in the kube-dra-exporter chart): the chart renders the exporter's flags from exporter.* and otlp.*; use extraEnv for anything else" }}
{{- end }}
{{- if .Values.featureGates }}
{{- fail "featureGates is not supported (as in the kube-dra-exporter chart): the exporter has no feature gates" }}
{{- end }}
{{- if hasKey .Values "maxConcurrentChallenges" }}
{{- fail "maxConcurrentChallenges is an obsolete option (rejected by the kube-dra-exporter chart too): remove it" }}
{{- end }}
{{- /* Two device attributes that become the same label make the exporter exit at start-up; the
     schema cannot see that, so compute each label as DeviceAttributes.parse does
     (otel_dra/cluster/resourceslice.py: "attribute_" + the name after the domain in snake case). */}}
{{- $labels := dict }}
{{- range .Values.exporter.deviceAttributes }}
{{- $label := regexReplaceAll "([A-Z]+)([A-Z][a-z])" (splitList "/" . | last) "${1}_${2}" }}
{{- $label = regexReplaceAll "([a-z0-9])([A-Z])" $label "${1}_${2}" }}
{{- $label = regexReplaceAll "[^a-z0-9]+" (lower $label) "_" | trimAll "_" }}
{{- if hasKey $labels $label }}
{{- fail (printf "exporter.deviceAttributes: %q and %q both become the label attribute_%s" (get $labels $label) . $label) }}
{{- end }}
{{- $_ := set $labels $label . }}
{{- end }}
{{- end }}

{{/* "true" when the exporter watches pods, else "": exporter.watchPods is on and the metric lists
     serve at least one family that reads pods, decided as the exporter decides it (ClusterState in
     otel_dra/cluster/exporter.py, FamilySelection in otel_dra/cluster/selection.py): the joined list
     split on commas, entries trimmed, empty ones dropped; an entry selects a family when it matches
     the whole Prometheus name; an allowlist serves what some entry selects, a denylist (or no list)
     what none does. The ClusterRole asks for pods only then (least privilege). $podFamilies are the
     families that read pods (otel_dra/cluster/pod.py STATE_FAMILIES; no joined family reads pods):
     tests/unit/test_selection.py fails when the two lists differ.
     The exporter's entries are Python regular expressions, matched here with Go's RE2; where RE2
     cannot compile an entry (a lookahead, a backreference) the chart cannot tell, and grants pods
     rather than leave the exporter without them. */}}
{{- define "otel-dra.exporterWatchesPods" -}}
{{- $podFamilies := list "kube_pod_resourceclaim_info" "kube_pod_resourceclaim_device_health" }}
{{- if .Values.exporter.watchPods }}
{{- $allow := not (empty .Values.exporter.metricAllowlist) }}
{{- $entries := list }}
{{- range splitList "," (join "," (ternary .Values.exporter.metricAllowlist .Values.exporter.metricDenylist $allow)) }}
{{- with trim . }}
{{- $entries = append $entries . }}
{{- end }}
{{- end }}
{{- $allow = and $allow (gt (len $entries) 0) }}
{{- $served := false }}
{{- range $name := $podFamilies }}
{{- $selected := false }}
{{- range $entries }}
{{- /* "(?:RE)|" matches the empty string whenever RE2 compiles RE (regexMatch is false on an error). */}}
{{- $compiles := regexMatch (printf "(?:%s)|" .) "" }}
{{- if or (regexMatch (printf "^(?:%s)$" .) $name) (and (not $compiles) $allow) }}
{{- $selected = true }}
{{- end }}
{{- end }}
{{- if eq $selected $allow }}
{{- $served = true }}
{{- end }}
{{- end }}
{{- if $served }}true{{ end }}
{{- end }}
{{- end }}

{{/* The exporter pod template, shared by the Deployment and the sharded StatefulSet. */}}
{{- define "otel-dra.podTemplate" -}}
metadata:
  labels:
    {{- include "otel-dra.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "otel-dra.serviceAccountName" . }}
  automountServiceAccountToken: true
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: exporter
      image: {{ include "otel-dra.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - exporter
        - --port=8080
        - --stale-after={{ .Values.exporter.staleAfter }}
        - --log-format={{ .Values.exporter.logFormat }}
        - --log-level={{ .Values.exporter.logLevel }}
        - --target-info={{ .Values.exporter.targetInfo }}
        - --device-attributes={{ join "," .Values.exporter.deviceAttributes }}
        - --leak-grace-period={{ .Values.exporter.leakGracePeriod }}
        {{- with .Values.exporter.metricAllowlist }}
        - {{ printf "--metric-allowlist=%s" (join "," .) | quote }}
        {{- end }}
        {{- with .Values.exporter.metricDenylist }}
        - {{ printf "--metric-denylist=%s" (join "," .) | quote }}
        {{- end }}
        - --watch-pods={{ .Values.exporter.watchPods }}
        {{- if .Values.sharding.enabled }}
        - --shard=auto
        - --total-shards={{ .Values.sharding.shards }}
        {{- end }}
        {{- with include "otel-dra.webArgs" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- with include "otel-dra.otlpEnv" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        - name: OTEL_SERVICE_NAME
          value: {{ default (include "otel-dra.fullname" .) .Values.otlp.serviceName | quote }}
        - name: OTEL_RESOURCE_ATTRIBUTES
          value: {{ printf "k8s.pod.name=$(POD_NAME)%s" (ternary (printf ",%s" .Values.otlp.resourceAttributes) "" (ne .Values.otlp.resourceAttributes "")) | quote }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: 8080
          protocol: TCP
      {{- if .Values.metricsSecurity.tls.enabled }}
      # /healthz and /readyz need no credentials (over HTTPS the kubelet does not verify certificates).
      {{- end }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
          {{- if .Values.metricsSecurity.tls.enabled }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: 10
        failureThreshold: 3
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
          {{- if .Values.metricsSecurity.tls.enabled }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: 5
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      {{- $mounts := include "otel-dra.webVolumeMounts" . | trim }}
      {{- if or $mounts .Values.extraVolumeMounts }}
      volumeMounts:
        {{- with $mounts }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
  {{- $volumes := include "otel-dra.webVolumes" . | trim }}
  {{- if or $volumes .Values.extraVolumes }}
  volumes:
    {{- with $volumes }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* --- the DRA kubelet plugin (plugin.enabled) ------------------------------------------------ */}}

{{- define "otel-dra.plugin.fullname" -}}
{{- printf "%s-kubeletplugin" (include "otel-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "otel-dra.plugin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "otel-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubeletplugin
{{- end }}

{{- define "otel-dra.plugin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "otel-dra.plugin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "otel-dra.plugin.serviceAccountName" -}}
{{- if .Values.plugin.serviceAccount.create }}
{{- default (include "otel-dra.plugin.fullname" .) .Values.plugin.serviceAccount.name }}
{{- else }}
{{- required "plugin.serviceAccount.name is required when plugin.serviceAccount.create=false" .Values.plugin.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The metrics Service keeps the dra-example-driver's name, `<release>-kubeletplugin-metrics`, so
     existing scrape configs and dashboards find it. */}}
{{- define "otel-dra.plugin.metricsServiceName" -}}
{{- printf "%s-kubeletplugin-metrics" (.Release.Name | trunc 41 | trimSuffix "-") }}
{{- end }}

{{- define "otel-dra.plugin.deviceClassName" -}}
{{- default .Values.plugin.driverName .Values.plugin.deviceClass.name }}
{{- end }}

{{/* OTEL_EXPORTER_OTLP_* from otlp.* (exporter and plugin alike); nothing when otlp.endpoint is empty. */}}
{{- define "otel-dra.otlpEnv" -}}
{{- if .Values.otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otlp.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.otlp.protocol | quote }}
- name: OTEL_METRIC_EXPORT_INTERVAL
  value: {{ .Values.otlp.exportInterval | quote }}
{{- if .Values.otlp.insecure }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: "true"
{{- end }}
{{- with .Values.otlp.headers }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* --- /metrics security (metricsSecurity), the exporter and the plugin alike ------------------- */}}

{{- define "otel-dra.metricsTLS" -}}
{{- if .Values.metricsSecurity.tls.enabled }}true{{ end }}
{{- end }}

{{- define "otel-dra.metricsAuthz" -}}
{{- if eq .Values.metricsSecurity.authorization.mode "kubernetes" }}true{{ end }}
{{- end }}

{{/* The Secret with tls.crt, tls.key and ca.crt: metricsSecurity.tls.existingSecret, else the one
     the cert-manager Certificate writes. */}}
{{- define "otel-dra.metricsTLSSecret" -}}
{{- default (printf "%s-metrics-tls" (include "otel-dra.fullname" .)) .Values.metricsSecurity.tls.existingSecret }}
{{- end }}

{{/* "true" when the pods get a --web-config-file (TLS or extra headers). */}}
{{- define "otel-dra.webConfig" -}}
{{- if or .Values.metricsSecurity.tls.enabled .Values.metricsSecurity.headers }}true{{ end }}
{{- end }}

{{- define "otel-dra.webConfigName" -}}
{{- printf "%s-web-config" (include "otel-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The web config file (exporter-toolkit format) the ConfigMap carries. */}}
{{- define "otel-dra.webConfigFile" -}}
{{- $s := .Values.metricsSecurity }}
{{- $file := dict }}
{{- if $s.tls.enabled }}
{{- $tls := dict "cert_file" "/etc/otel-dra/tls/tls.crt" "key_file" "/etc/otel-dra/tls/tls.key" "min_version" $s.tls.minVersion }}
{{- with $s.tls.cipherSuites }}
{{- $_ := set $tls "cipher_suites" . }}
{{- end }}
{{- $_ := set $file "tls_server_config" $tls }}
{{- end }}
{{- with $s.headers }}
{{- $_ := set $file "http_server_config" (dict "headers" .) }}
{{- end }}
{{- toYaml $file }}
{{- end }}

{{/* Container args for metricsSecurity (exporter and plugin). */}}
{{- define "otel-dra.webArgs" -}}
{{- if include "otel-dra.webConfig" . }}
- --web-config-file=/etc/otel-dra/web/web-config.yml
{{- end }}
{{- if include "otel-dra.metricsAuthz" . }}
- --authorization=kubernetes
- --authorization-allow-ttl={{ .Values.metricsSecurity.authorization.allowTTL }}
- --authorization-deny-ttl={{ .Values.metricsSecurity.authorization.denyTTL }}
{{- end }}
{{- end }}

{{- define "otel-dra.webVolumeMounts" -}}
{{- if include "otel-dra.webConfig" . }}
- name: web-config
  mountPath: /etc/otel-dra/web
  readOnly: true
{{- end }}
{{- if include "otel-dra.metricsTLS" . }}
# A whole-directory Secret mount (no subPath): the kubelet swaps renewed files in, and the server
# re-reads them at the next connection.
- name: metrics-tls
  mountPath: /etc/otel-dra/tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "otel-dra.webVolumes" -}}
{{- if include "otel-dra.webConfig" . }}
- name: web-config
  configMap:
    name: {{ include "otel-dra.webConfigName" . }}
{{- end }}
{{- if include "otel-dra.metricsTLS" . }}
- name: metrics-tls
  secret:
    secretName: {{ include "otel-dra.metricsTLSSecret" . }}
{{- end }}
{{- end }}

{{/* RBAC rules the exporter and the plugin need for --authorization=kubernetes. */}}
{{- define "otel-dra.reviewRules" -}}
{{- if include "otel-dra.metricsAuthz" . }}
# --authorization=kubernetes: checking a scraper's token (TokenReview) and whether its user may get
# /metrics (SubjectAccessReview).
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
- apiGroups: ["authorization.k8s.io"]
  resources: ["subjectaccessreviews"]
  verbs: ["create"]
{{- end }}
{{- end }}

{{/* A monitor endpoint's scheme, TLS and credentials; pass (dict "ctx" $ "serverName" "<svc>.<ns>.svc"
     "kind" "ServiceMonitor"|"PodMonitor"). */}}
{{- define "otel-dra.monitorSecurity" -}}
{{- $ := .ctx }}
{{- $s := $.Values.metricsSecurity }}
{{- if $s.tls.enabled }}
scheme: https
tlsConfig:
  serverName: {{ .serverName }}
  ca:
    secret:
      name: {{ include "otel-dra.metricsTLSSecret" $ }}
      key: ca.crt
{{- end }}
{{- if include "otel-dra.metricsAuthz" $ }}
{{- if $s.scraper.tokenSecret.name }}
authorization:
  type: Bearer
  credentials:
    name: {{ $s.scraper.tokenSecret.name }}
    key: {{ $s.scraper.tokenSecret.key }}
{{- else }}
# The Prometheus pod's own ServiceAccount token.
bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
{{- end }}
{{- end }}
{{- end }}
